"""redraft.server"""
