"""redraft.kernels"""
