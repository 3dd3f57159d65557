"""The commands manage.py finds, one module each."""
