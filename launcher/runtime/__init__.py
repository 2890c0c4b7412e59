"""The mechanism below the backends: process handles and groups, local processes, labelled
output, the processes node agents run (remote.py) and the hub they report to. Every backend builds
on these."""
