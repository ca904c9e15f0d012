"""gs:// tests against a local GCS emulator (see emulator.py).

A package, so that its conftest is imported as ``gcs.conftest`` and does not shadow
``tests/conftest.py`` (other tests do ``from conftest import ...``).
"""
