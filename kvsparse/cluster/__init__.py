"""The cluster wing: starting and watching server and worker processes.

`launch` runs a whole job on this host (``kvsparse launch -s S -n N --
cmd``). It starts servers as child processes and never imports the server
code beyond reading their listening line. `process` is what it shares with
`kvsparse.ray`: the server command line, starting a server and reading its
listening line, bind retries, and the environment a child inherits.
`rendezvous` is where the launchers of a job over several hosts meet
(``kvsparse launch --nnodes N``): they exchange their servers' addresses,
agree on ranks, and end the job together.
"""
