"""FlexLB engine workers: the agent loop and the engines it drives (imports only `schemas`)."""
