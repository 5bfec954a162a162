"""redraft.engine"""
