"""The test-bed of rayckpt's own tests and benchmarks, not shipped in the wheel: hosts on one machine and Ray on them.

``hosts`` (network, mount and PID namespaces joined by veth pairs; needs root),
``ray_hosts`` (a Ray node on each host and an S3 host), ``launcher_hosts`` (hosts with
sshd, for ``ray up``), ``host_jobs`` (a job submitted to such hosts, followed) and
``ray_head`` (``ray start --head`` on this machine, with its own temp dir and ports) and
``s3_counter`` (moto's S3 server counting every request and its bytes, for the S3 tests and benchmarks).
What a user's own tests need ships in ``rayckpt.testing``.
"""
