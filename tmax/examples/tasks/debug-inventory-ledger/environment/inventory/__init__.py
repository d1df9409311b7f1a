"""Tiny stock ledger: parse movement files and compute stock levels per warehouse."""
