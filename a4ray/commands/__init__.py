"""`a4ray <subcommand>` implementations: argument parsing and printing over the library."""
