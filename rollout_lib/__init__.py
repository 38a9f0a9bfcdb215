"""Rollout Runtime v2: measure rollout backends on a preregistered workload.

Data flows one way: preregistration -> workload -> backend -> runner -> raw JSON -> calculator ->
aggregate JSON -> tables/plots -> HTML. Nothing downstream reaches back upstream.
"""

__version__ = "0.1.0"
