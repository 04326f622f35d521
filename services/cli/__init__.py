"""The ``hadar`` command line: one entry point, one module per subcommand group."""
