"""The engine loop: requests in, one scheduled device step at a time, outputs out (LLMEngine, its asyncio front,
output processing, incremental detokenising, beam-search driving, tokenizer glue). It drives the host core and
the runner and is the only layer that sees both."""
