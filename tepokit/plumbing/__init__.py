"""plumbing"""
