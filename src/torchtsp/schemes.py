"""Names of the parallel schemes (torch-free, for the command line)."""

# scheme -> "module:class" under torchtsp.parallel; imported on first use.
SCHEMES = {
    "tsp": "tsp:TSPTransformer",
    "dp": "dp:DPTransformer",
    "tp": "tp:TPTransformer",
    "sp": "sp:SPTransformer",
    "tp_sp": "tp_sp:TPSPTransformer",
    "torch_tp": "torch_tp:TorchTPTransformer",
}
