"""Bridges from this project's single-file objectives to other trainers (TRL: trl_trainers.py)."""
