"""What the workloads' readers share: word tokens and vocabularies, batch orders and lengths, the Gutenberg books."""
