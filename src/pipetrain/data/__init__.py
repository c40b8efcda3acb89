"""The data people bring: rows of JSON lines, Parquet or `datasets` folders (read memory-mapped through Hugging Face
`datasets` and `pyarrow`), turned into tokenized documents with label masks (plain text, prompt/answer pairs, chat
messages through the tokenizer's chat template), tokenized once and cached on disk, then cut to the window.

`formats` finds and reads the files, `fields` says which fields hold the text and what a row longer than the
window does, `render` turns one batch of rows into token ids and the mask of the tokens that train, `cache` runs
the tokenization once (in parallel, with a progress bar) keyed by the tokenizer and the data's content, and `rows`
holds the result as train and held-out samples that a batch reads from the memory-mapped files.
Needs the optional extra: `pip install 'pipetrain[data]'`.
"""
