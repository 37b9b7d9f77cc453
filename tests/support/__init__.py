"""Helpers shared by the tests and the documented long runs (chaos, load, oracle, long chat).

Tests import these as ``support.<module>``; pytest puts ``tests/`` on ``sys.path`` (rootdir
conftest), and ``python tests/<run>.py`` does too, as the script's own directory.
"""
