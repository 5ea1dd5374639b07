"""Demos of the whole system on loopback; not part of any daemon, and nothing imports them.

``fleet``   ``make demo``: etcd, BIND9, three regions of simulated nodes behind agents, two
            controllers, a regional failover, a leader kill, the ramp back, then ``meridianctl``
``region``  ``make demo-region``: one region up close, a drain and a node kill under traffic
"""
