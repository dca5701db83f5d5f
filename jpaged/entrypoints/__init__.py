"""How users reach the engine from Python and the shell: `LLM` / `generate` (llm.py) and the `jpaged` command
(cli.py). The HTTP server is the jpaged_server package (the repository's server/ folder)."""
