"""Data: the DAPO prompt template (template.py), readers for DAPO-Math-17k / AIME / MATH-500 / GSM8K into one row
schema (readers.py), the procedural arithmetic task of the CPU job (task.py) and its offline tokenizer
(tokenizer.py). Import the submodules directly; nothing heavy is imported here."""
