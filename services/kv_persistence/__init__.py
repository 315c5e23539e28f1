"""kv-persistence: the trie index of persisted Full Blocks (lookup, commit, remove)."""
