import verifiers.v1 as vf


class ColorTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "colors"

    @vf.tool
    async def get_color(self, name: str) -> str:
        """Look a colour up by name."""
        return f"the colour is {name}"


if __name__ == "__main__":
    ColorTools.run()
