"""From a dataset to the rows a step reads: sources, formats and packing (loading), tokenized rows
kept on disk (prepared), and the embedded byte-level tokenizer (tokenizer)."""
