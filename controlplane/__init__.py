"""The global controller: region health windows, failover, DNS steering and the admin API."""
