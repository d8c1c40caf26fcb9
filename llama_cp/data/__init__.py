"""From a dataset to the rows a step reads: the syntax of --dataset's sources (grammar), where examples
come from (sources), their formats (formats, chat), packing into rows (packing), preference pairs for DPO
(preference), the synthetic passkey task (passkey), rows and batches for the trainer (loader), tokenized
rows kept on disk (prepared; their key: cache_key; one split prepared: split_rows; the files: row_files),
rows packed from a stream as it is read (streaming), and the tokenizer: a model's own or the embedded
byte-level one (tokenizer)."""
