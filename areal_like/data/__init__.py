"""Datasets (verl-format parquet), the local character tokenizer and the tiny demo model builder."""
