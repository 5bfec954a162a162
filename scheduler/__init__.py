"""redraft.scheduler"""
