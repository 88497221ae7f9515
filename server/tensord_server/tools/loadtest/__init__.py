"""The load test, in one home: the runner, the Locust file and the workloads.

- :mod:`.runner`: ``tensord loadtest``: starts a server, Locust and the sampler; writes the report
- :mod:`.workloads`: the workloads as plain classes over the SDK (no Locust, no gevent)
- :mod:`.nodes`: a run against a cluster: its nodes, their baselines and leaks, the
  cross-node operations counted
- ``locustfile.py``: one Locust user class per workload (imports gevent: Locust loads it
  by path, nothing imports it)
"""
