"""The `mlxq` command line and the tools around the daemon: the embedded Valkey, the
BLAS preload, the demo model, `mlxq bench` and the fleet simulation. The daemon is
`worker`, the SDK `client`; this package only drives them."""
