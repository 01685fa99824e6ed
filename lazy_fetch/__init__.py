"""The node daemon: lazy chunk fetching, local cache, layer mounts (kernel and fuse modes), traces."""
