from gym_runtime.cli import program

program()
