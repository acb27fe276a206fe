"""_kits"""
