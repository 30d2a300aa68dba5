"""The library side of the offline commands: their configurations (``command_config``), ``launch.py eval``
(``evaluation``) and ``launch.py export`` (``exporting``)."""
