"""Batch jobs over files of prompts, on one host or over Ray replicas."""
