"""FlexLB wire contract: events, commands, API bodies, subjects and streams.

This package imports only msgspec and the standard library. Both the router (`services/`)
and the engine workers (`workers/`) depend on it; it depends on neither.
"""
