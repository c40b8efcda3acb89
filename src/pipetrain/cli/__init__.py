"""The command line: one module per verb (`add_parser` + `run`), the flag groups they share, logging set up only here."""
