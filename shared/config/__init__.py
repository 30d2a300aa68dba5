"""What a run and a command are asked to do: the run's configuration (``run_config``: ``RunConfig`` and its
sections, the settings machinery every command's configuration is declared with) and the one check that a
command's outputs are not its inputs (``outputs``)."""
