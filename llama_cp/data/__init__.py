"""From a dataset to the rows a step reads: where examples come from (sources), their formats
(formats, chat), packing into rows (packing), preference pairs for DPO (preference), the synthetic passkey task (passkey), rows and
batches for the trainer (loader), tokenized rows kept on disk (prepared), rows packed from a
stream as it is read (streaming), and the tokenizer: a model's own or the embedded byte-level one (tokenizer)."""
