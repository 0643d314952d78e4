"""Ragged paged attention: prefill chunks and decode tokens mixed, over a paged KV pool."""
