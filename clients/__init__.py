"""redraft.clients"""
