"""Runnable examples (``python examples/<name>.py``). A package too, so that the tests import them by name from the
repository root rather than load them by file path."""
