"""Hydra configuration groups for blockdraft (installed as package data so entry points find them)."""
