"""The pure scheduling core: projections, policies, batchers, admission.

Nothing here does I/O, reads a clock or uses the global RNG: `now_ns`, a seeded
`random.Random` and ids are passed in, so tests, replay and benchmarks drive it directly.
It imports only `schemas` and the standard library.
"""
