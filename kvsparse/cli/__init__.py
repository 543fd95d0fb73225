"""The ``kvsparse`` command line: ``launch``, ``server``, ``stats``, ``keys``."""
