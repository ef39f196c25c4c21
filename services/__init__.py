"""The FlexLB router: a pure scheduling core (`services.core`), an I/O shell
(`services.shell`), the HTTP API (`services.api`) and the command line (`services.cli`)."""
