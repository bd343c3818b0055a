"""The entrance: every `rlproxy ...` command (`main.py`), its options and output (`options.py`,
`output.py`), and the processes the long commands run (`processes.py`). Nothing imports this package."""
