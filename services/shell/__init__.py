"""The router's imperative shell: NATS, Redis, timers, HTTP wiring around the pure core."""
