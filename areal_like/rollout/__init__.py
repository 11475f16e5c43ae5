"""Rollout workers, the staleness gate client and the workflow executor."""
