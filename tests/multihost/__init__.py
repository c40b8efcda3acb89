"""Jobs across two hosts made of network namespaces (root and `ip netns` needed; skipped without)."""
