"""What an operator watches: the metric definitions, the Grafana dashboard and the Prometheus alert rules
made from them, and a run's checkpoint timeline as a picture.

Ray-free and torch-free: ``metric_defs`` (every metric's name, kind, tags), ``dashboard``
(the Grafana dashboard JSON, and installing it where Ray's Grafana looks), ``alerts`` (the
alert rules on checkpoint age, ``rayckpt dashboard alerts``) and ``timeline``
(``rayckpt status --plot``, with matplotlib). The Ray
side, which records the metrics and gathers what ``status`` shows, is ``rayckpt.ray``
(``metrics``, ``status``). May import only the base modules (``errors``, ``redaction``...).
"""
