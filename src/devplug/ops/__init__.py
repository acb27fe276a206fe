"""Operations: what an operator and the node's supervisors see of the daemon.

:mod:`.http` serves ``/metrics``, ``/healthz`` and ``/readyz`` on the event loop;
:mod:`.metrics` keeps the Prometheus numbers (prometheus_client loads at the first scrape);
:mod:`.systemd` speaks the notify protocol; :mod:`.limits` raises the descriptor limit at start;
:mod:`.control` carries an operator's commands (cordon, uncordon, status) on a local socket;
:mod:`.admission` decides, for both listeners, who gets a connection and for how long.

May use: the model, the version and prometheus_client. Never the other fronts: the composition
feeds it what they do.
"""
