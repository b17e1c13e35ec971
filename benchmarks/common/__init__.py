"""What every benchmark group shares: ``harness`` (timing, sampling, statistics, targets, the one table
renderer, the result files), ``systems`` (the systems measured, behind one adapter each), ``workload``
(the states saved and their checks), ``raytrain``, ``diskio`` and ``cli`` (the groups' entry points)."""
