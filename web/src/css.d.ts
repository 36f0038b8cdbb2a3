// Stylesheets are imported for their side effect: esbuild bundles them into the page's .css file.
declare module "*.css";
