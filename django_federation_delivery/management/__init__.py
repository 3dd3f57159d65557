"""The management commands and what they share: run_deliverer, delivery_status and the rest."""
